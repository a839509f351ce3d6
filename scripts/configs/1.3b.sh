# 1.3B-parameter Llama: one or two nodes, ZeRO-1. Sourced by scripts/launch.sh.
MODEL_ARGS=(--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
            --seq-length 2048 --vocab-size 32000)
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size 512 --train-iters 50000 --lr 3e-4 --min-lr 3e-5
            --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16 --zero-stage 1
            --log-interval 10 --eval-interval 1000 --eval-iters 20 --save-interval 1000 --keep-last 3)
