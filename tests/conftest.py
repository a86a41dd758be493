"""Suite-wide pytest setup: the cluster fixtures are shared by tests/cluster and tests/operator."""

pytest_plugins = ["tests.cluster_fixtures"]
