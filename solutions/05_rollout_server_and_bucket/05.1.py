# EXERCISE 05.1
import re

bucket_listing = ["policy-v9", "policy-v10", ".policy-v11.tmp-3f2a", "checkpoints", "policy-v8"]


def newest_version(names):
    found = [re.fullmatch(r"policy-v(\d+)", name) for name in names]
    return max(int(m.group(1)) for m in found if m)
