"""A traced step's kernels land in the model component and phase that ran them: named scopes
through the compiled HLO's op names, and library kernels inside a CUDA graph by the
schedule of the program (benchmarks/gpu_trace.py); a compiled program's launches counted
with the loops around them (benchmarks/hlo_launches.py); `--profile_steps` is parsed
strictly."""

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from k3jax import profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_trace  # noqa: E402  (benchmarks/ is not a package)
import hlo_launches  # noqa: E402


def test_op_names_give_component_and_phase():
  cases = {
      "jit(train_step)/jvp()/while/body/closed_call/kda/dot_general": ("kda", "forward"),
      "jit(train_step)/transpose(jvp(moe))/dispatch/experts/mpmd_map":
          ("moe.experts", "backward"),
      "jit(s)/transpose(jvp())/checkpoint/rematted_computation/attn_res/mul":
          ("attn_res", "recompute"),
      "jit(train_step)/jvp(moe)/router/logistic": ("moe.router", "forward"),
      "jit(train_step)/optimizer/muon/dot_general": ("optimizer", "update"),
      "jit(train_step)/jvp()/while/body/add": ("other", "forward"),
  }
  for op_name, want in cases.items():
    assert gpu_trace.component(op_name) == want, op_name


def _custom_call(name, operand, target, op_name):
  result = "(f32[4]{0}, s8[64]{0})" if "cublas" in target else "f32[4]{0}"  # + workspace
  return (f'  %{name} = {result} custom-call(%{operand}), custom_call_target="{target}", '
          f'metadata={{op_name="jit(train_step)/{op_name}"}}')


HLO = "\n".join([
    "HloModule jit_train_step, is_scheduled=true",
    "",
    "%fused_computation.1 (p: f32[4]) -> f32[4] {",
    "  %p = f32[4]{0} parameter(0)",
    '  ROOT %tanh.1 = f32[4]{0} tanh(%p), metadata={op_name="jit(train_step)/jvp(kda)/tanh"}',
    "}",
    "",
    "ENTRY %main.9 (a: f32[4]) -> f32[4] {",
    "  %a = f32[4]{0} parameter(0)",
    "  %fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1",
    _custom_call("custom-call.2", "fusion.1", "__cublas$lt$matmul", "jvp(kda)/dot_general"),
    "  %copy.3 = f32[4]{0} copy(%custom-call.2)",
    _custom_call("custom-call.4", "copy.3", "mosaic_gpu_v2",
                 "jvp(moe)/dispatch/experts/mpmd_map"),
    _custom_call("custom-call.5", "custom-call.4", "__cublas$lt$matmul",
                 "transpose(jvp(mla))/dot_general"),
    "  ROOT %fusion.6 = f32[4]{0} fusion(%custom-call.5), kind=kLoop, "
    'calls=%fused_computation.1, metadata={op_name="jit(train_step)/optimizer/add"}',
    "}",
])


@pytest.mark.parametrize("name, want", [
    ("_grad_p_kernel", "short conv kernels"), ("_grad_x_kernel__1", "short conv kernels"),
    ("_fwd_kernel", "short conv kernels"), ("_rec_fwd_kernel", "KDA kernels"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "cuBLAS / cuDNN matmuls")])
def test_kernel_names_give_their_kind(name, want):
  assert gpu_trace.kind(name) == want


def test_kernels_in_a_command_buffer_follow_the_schedule():
  """The graph's kernels name only the buffer: a fusion kernel by its own name, the library
  kernels as the next custom call of their kind in the schedule, a memset as its
  neighbour; a fused computation's op name stands in for a fusion without one, and a copy
  XLA added takes its operand's."""
  hlo = gpu_trace.parse_hlo(HLO)
  assert hlo.op_names["fusion.1"] == "jit(train_step)/jvp(kda)/tanh"
  assert hlo.op_names["copy.3"] == "jit(train_step)/jvp(kda)/dot_general"
  graph = [("fusion_1", 10), ("nvjet_sm90_tst_128x256", 20), ("Memset 0", 2),
           ("body_mosaic_gpu_kernel", 30), ("sm90_xmma_gemm_bf16", 30), ("fusion_6", 8)]
  kernels = [gpu_trace.Kernel(name, 1e3 * i, 1e3 * ms, "command_buffer_7", "")   # us
             for i, (name, ms) in enumerate(graph)]
  got = [(gpu_trace.component(op)[0], how)
         for op, how, _ in gpu_trace.attribute(kernels, hlo)]
  assert got == [("kda", "named"), ("kda", "scheduled"), ("kda", "neighbour"),
                 ("moe.experts", "scheduled"), ("mla", "scheduled"), ("optimizer", "named")]
  table = "\n".join(gpu_trace.component_table(kernels, hlo))
  # the graph's kernels above, summed per component and phase
  assert "| kda | 32.0 | 0.0 | 0.0 | 0.0 | 32.0 | 32.0% |" in table, table
  assert "| mla | 0.0 | 0.0 | 30.0 | 0.0 | 30.0 | 30.0% |" in table, table
  assert "| optimizer | 0.0 | 0.0 | 0.0 | 8.0 | 8.0 | 8.0% |" in table, table
  assert "scheduled 80.0%, named 18.0%, neighbour 2.0%" in table, table
  # one row per kernel, component, phase and result shape; the memset has no instruction
  ops = "\n".join(gpu_trace.op_table(kernels, hlo))
  assert "| `sm90_xmma_gemm_bf16` | mla | backward | f32[4] | 30.0 | 1 |" in ops, ops
  assert "| `Memset 0` | kda | forward |  | 2.0 | 1 |  |" in ops, ops
  # with each launch's work, its rate: TFLOP/s of a matmul, GB/s of the rest
  work = {"custom-call.5": hlo_launches.Cost(0, 3 * 10**10),
          "fusion.6": hlo_launches.Cost(8 * 10**6, 0)}
  ops = "\n".join(gpu_trace.op_table(kernels, hlo, work))
  assert "| `sm90_xmma_gemm_bf16` | mla | backward | f32[4] | 30.0 | 1 | 1 TFLOP/s |" in ops
  assert "| `fusion_6` | optimizer | update | f32[4] | 8.0 | 1 | 1 GB/s |" in ops, ops
  # an attribution computed once serves every table alike
  once = gpu_trace.attribute(kernels, hlo)
  assert gpu_trace.op_table(kernels, hlo, work, attributed=once) == ops.splitlines()
  assert gpu_trace.rates(kernels, hlo, work, once) == gpu_trace.rates(kernels, hlo, work)
  assert gpu_trace.rates(kernels, hlo, work) == (
      "elementwise launches 8.0 ms, 0.0 GB, 1 GB/s; cuBLAS matmuls 30.0 ms, 0.0 TFLOP, "
      "1 TFLOP/s")


def test_two_traced_steps_compare_by_component():
  """The before/after tables: each component's kernel ms summed over its phases in each
  step, the change, idle time beside them (a component one step lacks counts 0 there); and
  the same by kernel kind."""
  hlo = gpu_trace.parse_hlo(HLO)
  def step(graph):
    return [gpu_trace.Kernel(name, 1e3 * 40 * i, 1e3 * ms, "command_buffer_7", "")
            for i, (name, ms) in enumerate(graph)]
  before = gpu_trace.component_ms(step([("fusion_1", 10), ("nvjet_sm90_tst_128x256", 20),
                                        ("sm90_xmma_gemm_bf16", 30)]), hlo)
  after = gpu_trace.component_ms(step([("fusion_1", 10), ("nvjet_sm90_tst_128x256", 5),
                                       ("fusion_6", 8)]), hlo)
  assert before == {"kda": 30.0, "mla": 30.0, "idle": 50.0, "span": 110.0}, before
  assert after == {"kda": 15.0, "optimizer": 8.0, "idle": 65.0, "span": 88.0}, after
  table = gpu_trace.compare_table(before, after)
  assert table[0] == "| component | before ms | after ms | change ms | change |"
  assert "| kda | 30.0 | 15.0 | -15.0 | -50.0% |" in table, table
  assert "| mla | 30.0 | 0.0 | -30.0 | -100.0% |" in table, table
  assert "| optimizer | 0.0 | 8.0 | +8.0 | new |" in table, table
  assert table[-2:] == ["| idle | 50.0 | 65.0 | +15.0 | +30.0% |",
                        "| span | 110.0 | 88.0 | -22.0 | -20.0% |"], table
  # by kind: the kernels' names alone, no attribution to go wrong
  kinds = gpu_trace.compare_table(
      gpu_trace.kind_ms(step([("fusion_1", 10), ("sm90_xmma_gemm_bf16", 30)])),
      gpu_trace.kind_ms(step([("fusion_1", 4), ("nvjet_sm90_tst_128x256", 5)])), label="kind")
  assert kinds[0] == "| kind | before ms | after ms | change ms | change |"
  assert "| cuBLAS / cuDNN matmuls | 30.0 | 5.0 | -25.0 | -83.3% |" in kinds, kinds
  assert "| other XLA kernels | 10.0 | 4.0 | -6.0 | -60.0% |" in kinds, kinds


def test_idle_time_is_told_by_gap_length_with_the_kernels_around_the_longest():
  """The gaps no kernel ran in add up to the step's idle time; a kernel still running on
  another stream closes no gap; each gap names the kernel before and after it."""
  def k(name, start, dur):
    return gpu_trace.Kernel(name, start, dur, "", "")
  kernels = [k("fusion_1", 0, 10), k("nvjet_sm90_tst", 12, 20), k("fusion_2", 15, 5),
             k("mosaic_gpu_gmm", 40, 5), k("fusion_3", 200, 1), k("_chunk_bwd_kernel", 250, 1)]
  gaps = gpu_trace.idle_gaps(kernels)
  assert [(g, a.name, b.name) for g, a, b in gaps] == [
      (155, "mosaic_gpu_gmm", "fusion_3"), (49, "fusion_3", "_chunk_bwd_kernel"),
      (8, "nvjet_sm90_tst", "mosaic_gpu_gmm"), (2, "fusion_1", "nvjet_sm90_tst")]
  assert gpu_trace.busy_span(kernels) == (37, 251)  # the union of the intervals; 214 idle
  table = gpu_trace.gap_table(kernels, top=2)
  assert table[2:5] == ["| under 10 | 2 | 0.0 |", "| 10 to 100 | 1 | 0.0 |",
                        "| 100 and more | 1 | 0.2 |"], table
  assert table[-2:] == [
      "| 155 | `mosaic_gpu_gmm` (grouped matmuls (Mosaic GPU)) | `fusion_3` (other XLA kernels) |",
      "| 49 | `fusion_3` (other XLA kernels) | `_chunk_bwd_kernel` (KDA kernels) |"], table


def test_costs_are_a_fusions_bytes_and_a_matmuls_flops():
  """A run's cost: an elementwise launch reads its operands and writes its result; a cuBLAS
  call does 2 m n k FLOPs (k from its dot dimensions), [64, 16] x [16, 32] here."""
  text = "\n".join([
      "HloModule m, is_scheduled=true",
      "",
      "ENTRY %main (x: bf16[64,16], w: bf16[16,32]) -> f32[64,32] {",
      "  %x = bf16[64,16]{1,0} parameter(0)",
      "  %w = bf16[16,32]{1,0} parameter(1)",
      '  %custom-call.1 = (bf16[64,32]{1,0}, s8[64]{0}) custom-call(%x, %w), '
      'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
      '{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],'
      '"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}',
      "  %gte = bf16[64,32]{1,0} get-tuple-element(%custom-call.1), index=0",
      "  ROOT %fusion.2 = f32[64,32]{1,0} fusion(%gte), kind=kLoop, calls=%fused",
      "}",
  ])
  costs = hlo_launches.costs(text)
  assert costs["custom-call.1"] == hlo_launches.Cost(0, 2 * 64 * 32 * 16)
  assert costs["fusion.2"] == hlo_launches.Cost(64 * 32 * (4 + 2), 0)


def _fusion(n, scope, shape="f32[4]", dedup=None, kind="fusion"):
  """An HLO fusion line; dedup: the instruction whose kernel XLA runs it with."""
  meta = f' deduplicated_name="{dedup}"' if dedup else ""
  return (f"  %{kind}.{n} = {shape}{{0}} fusion(%a), kind=kLoop, calls=%c{n}, "
          f'metadata={{op_name="jit(train_step)/{scope}/add"{meta}}}')


def _triton(n, scope):
  return (f'  %custom-call.{n} = f32[4]{{0}} custom-call(%a), custom_call_target='
          f'"__gpu$xla.gpu.triton", backend_config={{ir = "...", name = "k"}}, '
          f'metadata={{op_name="jit(train_step)/{scope}/pallas_call"}}')


def _attributed(lines, kernel_names):
  hlo = gpu_trace.parse_hlo("\n".join([
      "HloModule m, is_scheduled=true", "",
      "ENTRY %main.9 (a: f32[4]) -> f32[4] {", "  %a = f32[4]{0} parameter(0)", *lines,
      "}"]))
  kernels = [gpu_trace.Kernel(name, 10.0 * i, 5.0, "command_buffer_7", "")
             for i, name in enumerate(kernel_names)]
  return [(a.instruction, gpu_trace.component(a.op_name)[0])
          for a in gpu_trace.attribute(kernels, hlo)]


def test_a_reused_fusion_kernel_keeps_the_schedule_moving():
  """XLA compiles identical fusions once (the others carry `deduplicated_name`): in a CUDA
  graph the second layer's add runs as kernel fusion_1. It stands for the next add of its
  kind in turn, so the second layer's Triton kernel is that layer's, not the first's again."""
  got = _attributed([_fusion(1, "kda"), _triton(2, "kda"), _fusion(3, "mla", dedup="fusion.1"),
                     _triton(4, "mla")], ["fusion_1", "k", "fusion_1", "k"])
  assert got == [("fusion.1", "kda"), ("custom-call.2", "kda"), ("fusion.3", "mla"),
                 ("custom-call.4", "mla")], got


def test_a_reused_kernel_run_out_of_schedule_order_stays_in_its_layer():
  """A CUDA graph runs the first layer's add after that layer's Triton kernel (they do not
  depend on each other): the add is still the first layer's, and the second layer's kernels
  the second's. Single ops wrapped as fusions share a kernel without `deduplicated_name`:
  their twins go by kind and shape."""
  for kind, dedup in (("fusion", "fusion.2"), ("wrapped_add", None)):
    got = _attributed(
        [_fusion(1, "kda", shape="f32[8]"), _fusion(2, "kda", kind=kind), _triton(3, "kda"),
         _fusion(4, "mla", dedup=dedup, kind=kind), _triton(5, "mla")],
        ["fusion_1", "k", f"{kind}_2", f"{kind}_2", "k"])
    assert got == [("fusion.1", "kda"), ("custom-call.3", "kda"), (f"{kind}.2", "kda"),
                   (f"{kind}.4", "mla"), ("custom-call.5", "mla")], (kind, got)


def test_a_cpu_trace_of_a_scoped_step_is_split_by_component(tmp_path, capsys):
  """End to end on this machine: the profiler's trace of a jitted gradient step whose parts
  run under the model's scope names, the compiled HLO beside it."""
  def loss(w, x):
    with jax.named_scope("kda"):
      x = jnp.tanh(x @ w)
    with jax.named_scope("moe"), jax.named_scope("experts"):
      x = jnp.sin(x @ w)
    return jnp.sum(x ** 2)

  step = jax.jit(jax.grad(loss))
  w, x = jnp.ones((256, 256)) / 256, jnp.ones((512, 256))
  compiled = step.lower(w, x).compile()
  compiled(w, x).block_until_ready()
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    compiled(w, x).block_until_ready()
  kernels = gpu_trace.gpu_kernels(gpu_trace.load(tmp_path))
  hlo = gpu_trace.parse_hlo(compiled.as_text())
  table = "\n".join(gpu_trace.component_table(kernels, hlo))
  rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
  assert "kda" in rows and "moe.experts" in rows, table
  for row in ("kda", "moe.experts"):   # forward and backward both ran
    fwd, _, bwd = (float(c) for c in rows[row].split(" | ")[1:4])
    assert fwd > 0 and bwd > 0, table
  # the command line, given the trace twice: the two tables, every change zero
  (tmp_path / "train_step.hlo.txt").write_text(compiled.as_text())
  gpu_trace.main(["gpu_trace.py", str(tmp_path), str(tmp_path)])
  out = capsys.readouterr().out
  assert "| component | " in out and "| kind | " in out, out
  changes = [line.split(" | ")[3] for line in out.splitlines() if line.count("|") == 6
             and not line.startswith(("| component", "| kind", "|---"))]
  assert changes and set(changes) == {"+0.0"}, out


@pytest.mark.parametrize("spec, want", [("5", (5, 5)), ("3,7", (3, 7)), ("", None),
                                        (None, None)])
def test_profile_steps_parse(spec, want):
  assert profile.parse_steps(spec) == want


@pytest.mark.parametrize("spec", ["0", "7,3", "x", "1,2,3"])
def test_profile_steps_refuse_nonsense(spec):
  with pytest.raises(ValueError, match="--profile_steps"):
    profile.parse_steps(spec)


def test_a_profiled_run_compiles_under_its_own_op_names():
  """The persistent cache hands back a program compiled under other scope names (JAX's key
  leaves names out); inside `names_in_cache_key(True)`, as a profiled run is, it does not."""
  salt = float(time.time_ns() % 999_983)   # a program no earlier run has cached

  def compiled_text(scope):
    def scoped(x):
      with jax.named_scope(scope):
        return jnp.sin(x) * salt
    return jax.jit(scoped).lower(jnp.ones(8)).compile().as_text()

  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  try:
    assert "first_name" in compiled_text("first_name")
    assert "first_name" in compiled_text("renamed")   # stale names from the cache
    with profile.names_in_cache_key(True):
      assert "renamed" in compiled_text("renamed")
    assert not jax.config.jax_compilation_cache_include_metadata_in_key
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def test_launches_run_as_often_as_the_loops_around_them():
  """A scoped elementwise op inside 5 iterations inside 3: 15 runs a step, each reading and
  writing its [64, 256] fp32 array at least; the table sums the bytes of all runs."""
  def f(x):
    def inner(_, x):
      with jax.named_scope("kda"):
        return jnp.tanh(x) * 2 + 1
    return jax.lax.fori_loop(0, 3, lambda _, x: jax.lax.fori_loop(0, 5, inner, x), x)

  text = jax.jit(f).lower(jnp.ones((64, 256))).compile().as_text()
  kda = [x for x in hlo_launches.launches(text) if x.component == "kda"]
  assert kda and all(x.runs == 15 for x in kda)
  assert sum(x.bytes for x in kda) >= 2 * 64 * 256 * 4
  row = next(r for r in hlo_launches.tables(kda, 1e6) if r.startswith("| kda |"))
  assert row.endswith(f"| {sum(x.bytes * x.runs for x in kda) / 1e6 * 1e3:.1f} |")  # ms
