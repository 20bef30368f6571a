"""`ConfigError`, the error of an impossible or unknown config setting, and `check`, which
raises it naming the field. Every package's config section validates itself with these;
imports nothing from k3jax."""


class ConfigError(ValueError):
  """An impossible or unknown configuration setting."""


def check(ok: bool, field: str, msg: str) -> None:
  """ConfigError "config.<field>: <msg>" unless `ok`."""
  if not ok:
    raise ConfigError(f"config.{field}: {msg}")
