"""slurmft.health: node health checks, each a small pure function over gathered facts."""
