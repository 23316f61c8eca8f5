"""Developer tools that are not part of the app: the demo model's data generator and training script."""
