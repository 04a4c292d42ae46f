#!/bin/sh
#SBATCH -p gpu -G1 -t 60
#SBATCH --mem=32G
cd "$SLURM_SUBMIT_DIR"
. ./venv/bin/activate
python -u main.py \
  --epochs=${EPOCHS:-10} \
  --lr 3e-4 \
  2>&1 | tee train.log
