# EXERCISE 10.2
prediction = 0.4  # about the baseline's: at a rate between the two, the run trains, if slowly
rescue = dict(learning_rate=5e-4)  # a rate 10x lower; max_grad_norm would not help (see below)
