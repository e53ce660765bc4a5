# Sourced by the scripts a lent GPU machine runs (gpu_bench.sh, gpu_rehearsal.sh): the machine's own Python
# with the carried wheels (.whl/) and this tree's trainer on the path, and what it has, printed once.
# NVLink multicast stays off on shared hosts (the device tool's rule).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The lent machines set PYTHONDONTWRITEBYTECODE=1 over a venv without __pycache__: every process compiles torch,
# transformers and FLA from source (22-24 s of each start; docs/gpu-rehearsal.md). CT 200's venv has its
# bytecode (pip writes it; L3's verify checks it), so the rehearsal keeps bytecode too, under a prefix any user
# can write.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/var/tmp/dflash-pycache}
# As the unit keeps them (hardening.j2): Triton autotune results on disk beside the kernels.
export TRITON_CACHE_AUTOTUNING=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/trainer/src:${PYTHONPATH:-}
# The trainer's own imports, before any section runs minutes into a call: a wheel the machine lacks (tomli-w,
# FLA) is named now. Returns 1; the callers stop on it.
if ! missing=$(python3 -c 'import dflash_trainer.config, fla' 2>&1); then
  echo "gpu_env: the trainer does not import on this machine: ${missing##*$'\n'}" >&2
  echo "gpu_env: fix: bash scripts/gpu_wheels.sh here, then carry .whl/ to the machine" >&2
  return 1
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
python3 -c 'import torch, transformers, triton, fla; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, "flash-linear-attention", fla.__version__, "gpus", torch.cuda.device_count())'
