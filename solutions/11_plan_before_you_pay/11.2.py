# EXERCISE 11.2
weights = 1.544e9 * 2 / 2**30  # GiB of bfloat16 weights: 2.88
per_token = 2 * 28 * 2 * 128 * 2  # bytes of one token's keys and values: 28,672
per_request = per_token * (1096 + 3000) / 2**30  # GiB of one full-length request: 0.109
requests_per_replica = int((0.85 * 131.3 - weights) / per_request)
