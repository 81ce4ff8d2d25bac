"""Which torch functions and tensor methods a modifier may call, and the graph operations they become
(attnforge/mods/graph.py). trace.py dispatches on these tables."""
import torch

KIND_DTYPES = {"f": torch.float32, "i": torch.int32, "b": torch.bool}  # (Flex's index tensors are int32)
CAST_METHODS = {"float": torch.float32, "double": torch.float64, "int": torch.int32, "long": torch.int64,
                "bool": torch.bool}

FUNC_NAMES = {torch.exp: "exp", torch.log: "log", torch.tanh: "tanh", torch.sqrt: "sqrt", torch.sigmoid: "sigmoid",
              torch.sin: "sin", torch.cos: "cos", torch.log2: "log2", torch.exp2: "exp2", torch.log1p: "log1p",
              torch.expm1: "expm1", torch.rsqrt: "rsqrt",
              torch.Tensor.exp: "exp", torch.Tensor.log: "log", torch.Tensor.tanh: "tanh",
              torch.Tensor.sigmoid: "sigmoid", torch.Tensor.sqrt: "sqrt"}
BINARY_FUNCS = {torch.minimum: "minimum", torch.maximum: "maximum", torch.min: "minimum", torch.max: "maximum",
                torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.eq: "eq", torch.ne: "ne",
                torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.pow: "pow",
                torch.remainder: "mod", torch.bitwise_and: "and", torch.bitwise_or: "or", torch.bitwise_xor: "xor",
                torch.bitwise_left_shift: "lshift", torch.bitwise_right_shift: "rshift", torch.fmod: "fmod",
                torch.floor_divide: "floordiv", torch.true_divide: "truediv"}
UNARY_FUNCS = {torch.neg: "neg", torch.floor: "floor", torch.ceil: "ceil", torch.round: "round", torch.trunc: "trunc",
               torch.sign: "sign"}
LIKE_FUNCS = {torch.ones_like: 1, torch.zeros_like: 0}
METHOD_ALIASES = {  # tensor methods on traced values -> the torch function _dispatch handles
    **{f.__name__: f for f in (torch.abs, torch.exp, torch.exp2, torch.log, torch.log2, torch.log1p, torch.expm1,
                                torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.clamp,
                                torch.clip, torch.add, torch.sub, torch.mul, torch.div, torch.true_divide,
                                torch.floor_divide, torch.remainder, torch.fmod, torch.pow, torch.neg, torch.minimum,
                                torch.maximum, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
                                torch.logical_and, torch.logical_or, torch.logical_xor, torch.logical_not,
                                torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor, torch.bitwise_not, torch.floor,
                                torch.ceil, torch.round, torch.trunc, torch.sign, torch.square)},
    "where": lambda x, cond, other: torch.where(cond, x, other), "type_as": lambda x, other: x.to(other)}
LOGICAL_FUNCS = {torch.logical_and: "and", torch.logical_or: "or", torch.logical_xor: "xor"}  # on nonzero-ness
