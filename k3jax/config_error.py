"""`ConfigError`, the error of an impossible or unknown config setting, and `check`, which
raises it naming the field (`check_backend`: a kernel backend's name, old names told their
new ones). Every package's config section validates itself with these; imports nothing from
k3jax."""


class ConfigError(ValueError):
  """An impossible or unknown configuration setting."""


def check(ok: bool, field: str, msg: str) -> None:
  """ConfigError "config.<field>: <msg>" unless `ok`."""
  if not ok:
    raise ConfigError(f"config.{field}: {msg}")


def check_backend(field: str, name: str, backends, renamed=None) -> None:
  """check that name is one of backends; an old name, a key of renamed {old: new}, is told
  its new one."""
  renamed = renamed or {}
  check(name not in renamed, field, f"{name!r} was renamed {renamed.get(name)!r}")
  check(name in backends, field, f"unknown backend {name!r} (known: {', '.join(backends)})")
