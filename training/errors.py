"""The training job's error for an option it cannot use.

``ConfigError`` sits at the bottom of ``training``: the configuration, publishing, the job
and the references command all raise it, and the command line maps it to exit status 2
(``training.cli``). A data file the job cannot read raises ``training.data.DataError``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An option has a value the job cannot use."""
