# 13B-parameter Llama (Llama-2 13B shape): several nodes, ZeRO-2 (gradients partitioned too). With tensor
# parallelism available, --tensor-model-parallel-size 2 within a node is the usual alternative.
# Sourced by scripts/launch.sh.
MODEL_ARGS=(--num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40
            --seq-length 4096 --vocab-size 32000 --untie-embeddings-and-output-weights)
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 100000 --lr 2e-4 --min-lr 2e-5
            --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16 --zero-stage 2
            --log-interval 10 --eval-interval 2000 --eval-iters 10 --save-interval 500 --keep-last 2)
