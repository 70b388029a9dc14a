"""The buffer: scored turns → training samples and batches, archive, pull API, imports."""
