#!/bin/bash -l
#SBATCH --job-name=llm
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out

set -euo pipefail
module purge
module load cuda/12.1 anaconda3
eval "$(conda shell.bash hook)"
conda activate myenv
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=29500
export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
echo "Running on $(hostname)"
mkdir -p logs
srun torchrun --nnodes $SLURM_NNODES --nproc_per_node 4 --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT \
    train.py --config configs/base.yaml --out "runs/${SLURM_JOB_NAME}_${SLURM_JOB_ID}"
