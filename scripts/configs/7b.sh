# 7B-parameter Llama (Llama-2 7B shape): several nodes, ZeRO-1 (add --coat-fp8 for FP8 states and
# activations). Sourced by scripts/launch.sh.
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
            --seq-length 4096 --vocab-size 32000 --untie-embeddings-and-output-weights)
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 100000 --lr 3e-4 --min-lr 3e-5
            --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16 --zero-stage 1
            --log-interval 10 --eval-interval 2000 --eval-iters 10 --save-interval 500 --keep-last 2)
