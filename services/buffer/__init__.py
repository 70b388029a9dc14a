"""The buffer: scored turns → training samples and batches (episodes joined with their
outcomes), archive, pull API, imports."""
