"""The coordinator: deploying a plan, sessions on the data plane, the engine and its policies, recovery."""
