"""torch FSDP (FSDP1, FSDP2) methods that shardkit's FSDP does not have, and what to do
instead: ``model.<name>`` raises an AttributeError that says so, rather than one about
the wrapped model's class."""

__all__ = ["TORCH_FSDP_ONLY"]

#: torch FSDP methods shardkit's FSDP does not have, and what to do instead
TORCH_FSDP_ONLY = {
    **dict.fromkeys(
        ("unshard", "reshard", "summon_full_params"),
        "a direct call under torch.no_grad() gathers the parameters it needs; for their "
        "values use get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))",
    ),
    **dict.fromkeys(
        (
            "set_reshard_after_forward",
            "set_reshard_after_backward",
            "set_is_last_backward",
            "set_modules_to_forward_prefetch",
            "set_modules_to_backward_prefetch",
        ),
        "resharding and prefetching are fixed at wrapping (reshard_after_forward=, "
        "forward_prefetch=, backward_prefetch=)",
    ),
    "set_gradient_divide_factor": "gradients are averaged over the ranks; scale the loss",
    "register_comm_hook": "FSDP reduce-scatters in its own dtype (compute_dtype, "
    "fp32_reduce_scatter); comm hooks are DDP's",
    "fsdp_modules": "the units are the FSDP instances in model.modules()",
    "check_is_root": "the outermost FSDP module is the root",
    **dict.fromkeys(
        ("optim_state_dict", "optim_state_dict_to_load", "full_optim_state_dict"),
        "use shardkit.checkpoint.state_dict.get_state_dict / set_state_dict, or the "
        "optimizer's own state_dict(), which holds this rank's rows",
    ),
}
