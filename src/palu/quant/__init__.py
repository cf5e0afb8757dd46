"""Quantisers of full keys and values (the baselines' building blocks): uniform min-max groups,
scalar codebooks (Lloyd-Max, weighted k-means), and how encoded tensors are counted."""
