"""The `--config` flag and `run(main)`, which every entry point calls instead of
`app.run(main)`: any config error (unknown key, with the nearest valid one; wrong type;
unloadable file; `ConfigError`) is one `config error: ...` line on stderr and exit 2."""

from __future__ import annotations

import difflib
import functools
import glob
import os
import re
import sys

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from k3jax import config as k3config

CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file "
                                         "(FILE[:arg]); override fields with --config.a.b=v.",
                                         lock_config=True)

EXIT_CONFIG_ERROR = 2  # 1 stays what a failed run (or absl's flag errors) exits with


def fail(msg: str, status: int = EXIT_CONFIG_ERROR):
  """Ends the program with `config error: msg` on stderr."""
  print(f"config error: {msg}", file=sys.stderr, flush=True)
  sys.exit(status)


def run(main):
  """absl's `app.run(main)`, with a config's errors as one line (module docstring)."""
  quiet_libtpu()

  @functools.wraps(main)
  def main_reporting_config_errors(argv):
    if not flags.FLAGS["verbosity"].present:  # absl turns INFO on; JAX's would include
      logging.set_verbosity(logging.WARNING)  # "Unable to initialize backend 'tpu'"
    try:
      return main(argv)
    except k3config.ConfigError as e:
      fail(str(e))

  app.run(main_reporting_config_errors, flags_parser=parse_flags)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with `--config` errors reported by `fail`."""
  try:
    rest = flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001  (ml_collections raises several kinds)
    msg = explain_config_error(e, argv)
    if msg is not None:
      fail(msg)
    if not isinstance(e, flags.Error):
      raise
    sys.stderr.write(f"FATAL Flags parsing error: {e}\n"
                     "Pass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)
  if CONFIG.value is None:
    fail(_REQUIRED)
  problem = _load_problem(CONFIG.value)  # ml_collections defers a missing file's error
  if problem is not None:
    fail(f"--config={_config_args(argv[1:])[0]}: {problem}")
  return rest


_REQUIRED = "--config=FILE[:arg] is required, e.g. --config=experiments/k3_tiny.py"


def explain_config_error(error: Exception, argv: list[str]) -> str | None:
  """One line on what is wrong with `argv`'s --config flags; None if not about them."""
  config_arg, keys = _config_args(argv[1:])
  text = str(error).strip()
  if config_arg is None:
    return _REQUIRED if "--config" in text else None
  try:
    cfg = flags.FLAGS["config"].parser.parse(config_arg)
  except Exception as e:  # noqa: BLE001
    cause = _innermost(e)
    if not isinstance(cause, (OSError, ValueError, KeyError, AttributeError, SyntaxError)):
      return None  # a bug inside the config file: its traceback says where
    return f"--config={config_arg}: {cause}"
  problem = _load_problem(cfg)
  if problem is not None:
    return f"--config={config_arg}: {problem}"
  for key in keys:
    msg = unknown_field(cfg, key)
    if msg is not None:
      return msg
  if isinstance(error, flags.Error) and text.startswith("flag --config"):
    return text.removeprefix("flag ").splitlines()[0]
  if isinstance(error, flags.Error) and "config." in text:
    return text.splitlines()[0]
  if keys and isinstance(error, (LookupError, AttributeError, TypeError, ValueError)):
    return f"the --config.* overrides: {type(error).__name__}: {text.splitlines()[0]}"
  return None


def config_from_args(argv: list[str]):
  """The validated config that argv (a program name, then --config and --config.* flags)
  gives, parsed as the --config flag parses; ConfigError explaining a bad flag."""
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, flag_values=fv, sys_argv=argv,
                                           lock_config=True)
  try:
    fv(argv)
    cfg = holder.value
    cfg.keys()
  except Exception as e:  # noqa: BLE001  (ml_collections raises several kinds)
    raise k3config.ConfigError(explain_config_error(e, argv) or str(e)) from None
  return k3config.validate(cfg)


def _load_problem(cfg) -> str | None:
  """What kept ml_collections from loading the config file; None if it loaded."""
  if cfg is None or isinstance(cfg, ml_collections.ConfigDict):
    return None
  try:
    getattr(cfg, "keys")
  except OSError as e:
    return str(e.__cause__ or e).strip().splitlines()[-1].strip()  # [Errno 2] No such file
  return None


def _config_args(args: list[str]) -> tuple[str | None, list[str]]:
  config_arg, keys = None, []
  for i, arg in enumerate(args):
    if arg == "--":
      break
    name, eq, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-"):
      continue
    if name == "config":
      config_arg = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    elif name.startswith(("config.", "noconfig.")):
      keys.append(name.partition(".")[2])
  return config_arg, keys


def _innermost(e: BaseException) -> BaseException:
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  return e


def _fields(node) -> list[str] | None:
  if isinstance(node, (ml_collections.ConfigDict, dict)):
    return list(node.keys())
  return None


def _leaf_paths(node, prefix: str = "") -> list[str]:
  out = []
  for name in _fields(node) or ():
    child = node[name]
    path = f"{prefix}{name}"
    out += _leaf_paths(child, path + ".") if _fields(child) is not None else [path]
  return out


def nearest_field(cfg, key: str) -> str | None:
  """The valid dotted key of `cfg` nearest to `key`, or None."""
  node, parts = cfg, []
  for part in key.split("."):
    names = _fields(node)
    if names is None:
      break
    if part not in names:
      close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
      if not close:
        break
      part = close[0]
    parts.append(part)
    node = node[part]
  else:
    return ".".join(parts)
  paths = _leaf_paths(cfg)
  ends = [p for p in paths if p.endswith("." + key)]
  if ends:
    return ends[0]
  close = difflib.get_close_matches(key, paths, n=1, cutoff=0.7)
  return close[0] if close else None


def unknown_field(cfg, key: str) -> str | None:
  """The message for a dotted `key` that is not a field of `cfg`; None if it is one."""
  node, seen = cfg, "config"
  for part in key.split("."):
    name, _, index = part.partition("[")
    names = _fields(node)
    if names is None:
      return (f"--config.{key} is not a field: {seen} is a value ({type(node).__name__}), "
              "not a group of fields")
    if name not in names:
      near = nearest_field(cfg, key)
      return f"--config.{key} is not a field" + (f"; did you mean {near}?" if near else "")
    node, seen = node[name], f"{seen}.{name}"
    for i in re.findall(r"\[([^\]]*)\]", "[" + index if index else ""):
      if not isinstance(node, (list, tuple)):
        return f"--config.{key} is not a field: {seen} is not a list"
      if not re.fullmatch(r"-?\d+", i) or not -len(node) <= int(i) < len(node):
        return f"--config.{key} is not a field: {seen} has {len(node)} entries"
      node, seen = node[int(i)], f"{seen}[{i}]"
  return None


# Set where a slice is configured: quiet_libtpu then leaves the environment alone.
_TPU_TOPOLOGY_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_HOST_BOUNDS",
                     "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY", "TPU_PROCESS_BOUNDS",
                     "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS")


def quiet_libtpu() -> None:
  """Without TPU chips, give libtpu single-host values; call before JAX starts."""
  if any(os.environ.get(k) for k in _TPU_TOPOLOGY_ENV):
    return
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  try:
    from jax._src.hardware_utils import num_available_tpu_chips_and_device_id  # noqa: PLC0415
    chips = num_available_tpu_chips_and_device_id()[0]
  except Exception:  # noqa: BLE001  (JAX's own probe moved: leave the environment alone)
    return
  if chips:
    return
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
  os.environ["TPU_HOST_BOUNDS"] = "1,1,1"
