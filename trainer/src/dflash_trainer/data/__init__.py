"""Training data: Arrow shards in, padded batches out; synthetic shards for the lab."""
