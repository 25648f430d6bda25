"""slurmft.train: the in-job side; the only package that imports torch."""
