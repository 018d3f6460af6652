"""How many actors a round gets: the Hessian detector, the scalers, the budget cap, MinionsRL."""
