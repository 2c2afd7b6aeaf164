from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class LabelRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: Tensor
    def __init__(self, inputs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Guarantee(_message.Message):
    __slots__ = ("epsilon", "delta", "basis", "neighbouring", "theorem", "order", "unsound_reasons")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURING_FIELD_NUMBER: _ClassVar[int]
    THEOREM_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    UNSOUND_REASONS_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    delta: float
    basis: str
    neighbouring: str
    theorem: str
    order: float
    unsound_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., basis: _Optional[str] = ..., neighbouring: _Optional[str] = ..., theorem: _Optional[str] = ..., order: _Optional[float] = ..., unsound_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class BudgetReply(_message.Message):
    __slots__ = ("epsilon_spent", "delta", "epsilon_limit", "mechanism", "sound", "queries_answered", "queries_abstained", "cache_hits", "guarantee", "affordable_queries")
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    SOUND_FIELD_NUMBER: _ClassVar[int]
    QUERIES_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    QUERIES_ABSTAINED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    GUARANTEE_FIELD_NUMBER: _ClassVar[int]
    AFFORDABLE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    epsilon_spent: float
    delta: float
    epsilon_limit: float
    mechanism: str
    sound: bool
    queries_answered: int
    queries_abstained: int
    cache_hits: int
    guarantee: Guarantee
    affordable_queries: int
    def __init__(self, epsilon_spent: _Optional[float] = ..., delta: _Optional[float] = ..., epsilon_limit: _Optional[float] = ..., mechanism: _Optional[str] = ..., sound: _Optional[bool] = ..., queries_answered: _Optional[int] = ..., queries_abstained: _Optional[int] = ..., cache_hits: _Optional[int] = ..., guarantee: _Optional[_Union[Guarantee, _Mapping]] = ..., affordable_queries: _Optional[int] = ...) -> None: ...

class LabelReply(_message.Message):
    __slots__ = ("labels", "answered", "budget", "budget_refused")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REFUSED_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[int]
    answered: int
    budget: BudgetReply
    budget_refused: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, labels: _Optional[_Iterable[int]] = ..., answered: _Optional[int] = ..., budget: _Optional[_Union[BudgetReply, _Mapping]] = ..., budget_refused: _Optional[_Iterable[bool]] = ...) -> None: ...

class BudgetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
