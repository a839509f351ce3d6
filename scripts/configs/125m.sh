# 125M-parameter Llama (GPT-3 Small shape): one node, data parallel. Sourced by scripts/launch.sh.
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --ffn-hidden-size 2048 --num-attention-heads 12
            --seq-length 2048 --vocab-size 32000)
TRAIN_ARGS=(--micro-batch-size 8 --global-batch-size 256 --train-iters 20000 --lr 6e-4 --min-lr 6e-5
            --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16 --zero-stage 1
            --log-interval 10 --eval-interval 1000 --eval-iters 20 --save-interval 1000 --keep-last 3)
