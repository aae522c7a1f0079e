"""The off-policy correction vs lag ablation: the grid of runs (`study`), its summary and its report."""
