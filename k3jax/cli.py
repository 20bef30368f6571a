"""Flags shared by the entry points (`train`, `params`): defined once, here."""

from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file "
                                         "(FILE[:arg]); override fields with --config.a.b=v.",
                                         lock_config=True)
