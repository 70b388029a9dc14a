"""The trainer: clipped policy-gradient steps on `batches`, versioned checkpoints in the bucket."""
