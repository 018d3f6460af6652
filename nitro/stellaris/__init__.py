"""Stellaris: serverless learner functions and the parameter server that applies their gradients."""
