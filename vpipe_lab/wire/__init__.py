"""The wire between controller and workers: messages, the authenticated channel, checkpoint format, job spec,
tensor encoding and private files. No torch: both sides import it."""
