"""Training: the Trainer, its loop, optimizer setup, metrics and writers."""
