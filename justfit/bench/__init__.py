"""`justfit bench …`: workloads that compare JustFit with mlx-lm in the same process."""
