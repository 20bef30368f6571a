"""Launchers: `local.py` (several CPU processes on this machine), `tpu_pod.sh`, `gke_jobset.yaml`,
`slurm_gpu.sbatch`."""
