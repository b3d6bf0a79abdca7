"""The Trainer flags the tests share."""

# no logger and no progress bar: a test's output is its assertions
SILENT = dict(logger=False, enable_progress_bar=False)
# ... and no checkpoint files, for tests that do not look at them
QUIET = dict(SILENT, enable_checkpointing=False)
