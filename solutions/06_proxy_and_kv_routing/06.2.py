# EXERCISE 06.2
# per prompt: affinity U + G t = 16 + 4 x 2 = 24 tokens, round-robin 3 U + G t = 56; the
# template's 32 tokens once on each of 3 replicas: (16 x 24 + 96) / (16 x 56 + 96)
prediction = round((16 * 24 + 3 * 32) / (16 * 56 + 3 * 32), 3)  # 0.484, from 0.636 with 2
replicas_in_run = 3  # the knob: replicas behind the proxy
