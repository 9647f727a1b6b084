"""shardfc: exact class-sharded softmax / margin losses for classifiers with millions of classes."""

__version__ = "0.1.0"
