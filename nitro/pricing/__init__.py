"""What a round costs: the ledger (Lambda or VM lines), the learner's clock, actors on EC2 instances."""
