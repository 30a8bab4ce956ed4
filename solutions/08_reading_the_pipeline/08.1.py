# EXERCISE 08.1
my_verdicts = {}
for name, r in runs.items():
    row = summarize(r)
    my_verdicts[name] = "generation" if row["wait_share"] > row["held_back_share"] else "trainer"
    print(f"{name:18s} waits {row['wait_share']:.0%}, held back {row['held_back_share']:.0%}"
          f" -> {my_verdicts[name]}")
