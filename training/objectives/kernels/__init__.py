"""The native kernels' C sources and, once installed, their libraries (see ``setup.py``)."""
