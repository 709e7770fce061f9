# Sourced by the GPU scripts, from the checkout's root: the environment every GPU command runs in.
# NVLink multicast stays off everywhere (NCCL, torch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The GPU machine has no package index, so nothing is installed: the import name `tp_overlap` is a link to
# overlap/ (which finds kernels/, symm_mem/, ... beside itself), and the checkout is on the path for `tests`.
TP_OVERLAP_LINK_DIR=${TP_OVERLAP_LINK_DIR:-/tmp/tp_overlap_path}
mkdir -p "$TP_OVERLAP_LINK_DIR" && ln -sfn "$PWD/overlap" "$TP_OVERLAP_LINK_DIR/tp_overlap"
export PYTHONPATH=$TP_OVERLAP_LINK_DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f .commit ] && export OVERLAP_GIT_COMMIT=$(cat .commit)
