# EXERCISE 09b.1
prediction = 0.6  # most prompts' replies agree at 0.3: right together or wrong together
exercise_temperature = 0.3  # set 0.3
