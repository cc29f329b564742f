"""A stage daemon: its gRPC servicer, the stage server, micro-batch compute, sequences and KV."""
