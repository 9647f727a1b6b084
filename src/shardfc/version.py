"""shardfc's version, in a module of its own so that any module can read it without importing the
package's ``__init__`` (which imports the head). ``shardfc.__version__`` is this one."""

__version__ = "0.1.0"
