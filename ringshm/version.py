"""The package's version, in one place: ``ringshm.__version__``, ``ringshm --version``, ``GET /version`` and
setup.py all read it from here."""

__version__ = "0.1.0"
