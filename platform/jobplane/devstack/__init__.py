"""The local dev stack: MongoDB and Redis started from pip-installed binaries."""

from jobplane.devstack.servers import LocalStack, MongoServer, RedisServer, ReplicaSet, free_port

__all__ = ["LocalStack", "MongoServer", "RedisServer", "ReplicaSet", "free_port"]
