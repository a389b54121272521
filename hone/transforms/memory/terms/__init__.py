"""One module per transform that changes a step's memory, each the term
:func:`hone.transforms.memory.estimate.estimate_memory` adds for it. A new transform that changes
what the step holds adds its module here and its call there."""
