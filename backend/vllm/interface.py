"""The model's inputs and outputs (compatible with the vLLM backend NVIDIA publishes), and the
``auto_complete_config`` that declares them. Nothing here imports vLLM: Triton starts a stub only to call
``auto_complete_config``, and that stub should not spend vLLM's import time."""

from __future__ import annotations

BOOL_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
OPTIONAL_OUTPUTS = {
    "return_finish_reason": ("finish_reason", "TYPE_STRING"),
    "return_cumulative_logprob": ("cumulative_logprob", "TYPE_FP32"),
    "return_logprobs": ("logprobs", "TYPE_STRING"),
    "return_num_input_tokens": ("num_input_tokens", "TYPE_UINT32"),
    "return_num_output_tokens": ("num_output_tokens", "TYPE_UINT32"),
}


def auto_complete_config(config):
    """Fill in what config.pbtxt leaves out: the inputs and outputs above, ``max_batch_size: 0`` and the
    decoupled transaction policy (one request, many responses)."""
    inputs = [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}]
    inputs += [{"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in BOOL_INPUTS]
    inputs += [{"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True}]
    outputs = [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}]
    outputs += [{"name": name, "data_type": dtype, "dims": [-1]} for name, dtype in OPTIONAL_OUTPUTS.values()]
    have_inputs = {i["name"] for i in config.as_dict().get("input", [])}
    have_outputs = {o["name"] for o in config.as_dict().get("output", [])}
    for spec in inputs:
        if spec["name"] not in have_inputs:
            config.add_input(spec)
    for spec in outputs:
        if spec["name"] not in have_outputs:
            config.add_output(spec)
    config.set_max_batch_size(0)
    config.set_model_transaction_policy({"decoupled": True})
    return config
