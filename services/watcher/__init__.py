"""The watcher: follows the bucket's LATEST and hot-reloads the engine."""
