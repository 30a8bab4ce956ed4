# EXERCISE 08.1
def my_bottleneck(n):
    if n["queue_fill"] >= 0.75 and n["wait_share"] <= 0.05 and n["held_back_share"] >= 0.2:
        return "trainer"  # full queue, no wait, generation held back: the step is too slow
    rising = n["wait_share"] >= 0.2 or (n["wait_slope_s"] > 0 and n["wait_share"] > 0.05)
    if n["queue_fill"] <= 0.25 and rising and n["held_back_share"] <= 0.05:
        return "generation"  # empty queue, a rising wait, nothing held back
    return "balanced"
