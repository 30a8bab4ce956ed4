# EXERCISE 06.1
def predicted_prefill_tokens(routing):
    # Prompt tokens the two replicas compute in one run of section 5 with `routing`
    block = 16
    own = (prompt_len - 1) // block * block - template_tokens  # the problem's full blocks: 16
    tail = prompt_len - template_tokens - own  # after the last full block: computed every time
    replicas_per_prompt = 1 if routing == "affinity" else min(2, group_size)  # who sees a prompt
    per_prompt = replicas_per_prompt * own + group_size * tail
    return routing_prompts * per_prompt + 2 * template_tokens  # the template once per replica
