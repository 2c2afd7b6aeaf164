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

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Description(_message.Message):
    __slots__ = ("owner", "records", "vote_sources", "mechanisms", "max_run_epsilon", "epsilon", "delta")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    VOTE_SOURCES_FIELD_NUMBER: _ClassVar[int]
    MECHANISMS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUN_EPSILON_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    owner: str
    records: int
    vote_sources: _containers.RepeatedScalarFieldContainer[str]
    mechanisms: _containers.RepeatedScalarFieldContainer[str]
    max_run_epsilon: float
    epsilon: float
    delta: float
    def __init__(self, owner: _Optional[str] = ..., records: _Optional[int] = ..., vote_sources: _Optional[_Iterable[str]] = ..., mechanisms: _Optional[_Iterable[str]] = ..., max_run_epsilon: _Optional[float] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ...) -> None: ...

class ClusterTerms(_message.Message):
    __slots__ = ("votes_per_record", "embedding", "dims")
    VOTES_PER_RECORD_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    votes_per_record: int
    embedding: str
    dims: int
    def __init__(self, votes_per_record: _Optional[int] = ..., embedding: _Optional[str] = ..., dims: _Optional[int] = ...) -> None: ...

class KnnTerms(_message.Message):
    __slots__ = ("k", "sample_rate", "embedding", "dims")
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    k: int
    sample_rate: float
    embedding: str
    dims: int
    def __init__(self, k: _Optional[int] = ..., sample_rate: _Optional[float] = ..., embedding: _Optional[str] = ..., dims: _Optional[int] = ...) -> None: ...

class TeacherTerms(_message.Message):
    __slots__ = ("model", "teachers", "epochs", "batch_size", "lr", "seed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEACHERS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    model: str
    teachers: int
    epochs: int
    batch_size: int
    lr: float
    seed: int
    def __init__(self, model: _Optional[str] = ..., teachers: _Optional[int] = ..., epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., lr: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class DpsgdTerms(_message.Message):
    __slots__ = ("model", "max_grad_norm", "noise_multiplier", "sample_rate", "steps", "seed", "parties", "records", "standardiser", "near_private", "arguments", "sparse")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    STANDARDISER_FIELD_NUMBER: _ClassVar[int]
    NEAR_PRIVATE_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_grad_norm: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    seed: int
    parties: _containers.RepeatedScalarFieldContainer[str]
    records: int
    standardiser: Standardiser
    near_private: NearPrivateTerms
    arguments: _containers.RepeatedCompositeFieldContainer[ModelArgument]
    sparse: SparseTerms
    def __init__(self, model: _Optional[str] = ..., max_grad_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., sample_rate: _Optional[float] = ..., steps: _Optional[int] = ..., seed: _Optional[int] = ..., parties: _Optional[_Iterable[str]] = ..., records: _Optional[int] = ..., standardiser: _Optional[_Union[Standardiser, _Mapping]] = ..., near_private: _Optional[_Union[NearPrivateTerms, _Mapping]] = ..., arguments: _Optional[_Iterable[_Union[ModelArgument, _Mapping]]] = ..., sparse: _Optional[_Union[SparseTerms, _Mapping]] = ...) -> None: ...

class ModelArgument(_message.Message):
    __slots__ = ("name", "integer", "real")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    REAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    integer: int
    real: float
    def __init__(self, name: _Optional[str] = ..., integer: _Optional[int] = ..., real: _Optional[float] = ...) -> None: ...

class SparseTerms(_message.Message):
    __slots__ = ("pretrained", "trained")
    PRETRAINED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    pretrained: _containers.RepeatedCompositeFieldContainer[Tensor]
    trained: _containers.RepeatedCompositeFieldContainer[TrainedEntries]
    def __init__(self, pretrained: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., trained: _Optional[_Iterable[_Union[TrainedEntries, _Mapping]]] = ...) -> None: ...

class TrainedEntries(_message.Message):
    __slots__ = ("parameter", "entries")
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    parameter: int
    entries: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parameter: _Optional[int] = ..., entries: _Optional[_Iterable[int]] = ...) -> None: ...

class NearPrivateTerms(_message.Message):
    __slots__ = ("pca_epsilon", "support_epsilon", "delta")
    PCA_EPSILON_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    pca_epsilon: float
    support_epsilon: float
    delta: float
    def __init__(self, pca_epsilon: _Optional[float] = ..., support_epsilon: _Optional[float] = ..., delta: _Optional[float] = ...) -> None: ...

class Standardiser(_message.Message):
    __slots__ = ("mean", "scale", "keep")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    mean: _containers.RepeatedScalarFieldContainer[float]
    scale: _containers.RepeatedScalarFieldContainer[float]
    keep: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, mean: _Optional[_Iterable[float]] = ..., scale: _Optional[_Iterable[float]] = ..., keep: _Optional[_Iterable[bool]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("run", "clusters", "knn", "teachers", "dpsgd", "mechanism", "sigma", "max_batch", "rounds", "lifetime_epsilon", "classes", "public_pool", "reading")
    RUN_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    KNN_FIELD_NUMBER: _ClassVar[int]
    TEACHERS_FIELD_NUMBER: _ClassVar[int]
    DPSGD_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    SIGMA_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_EPSILON_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_POOL_FIELD_NUMBER: _ClassVar[int]
    READING_FIELD_NUMBER: _ClassVar[int]
    run: str
    clusters: ClusterTerms
    knn: KnnTerms
    teachers: TeacherTerms
    dpsgd: DpsgdTerms
    mechanism: str
    sigma: float
    max_batch: int
    rounds: int
    lifetime_epsilon: float
    classes: _containers.RepeatedScalarFieldContainer[str]
    public_pool: Tensor
    reading: PublicReading
    def __init__(self, run: _Optional[str] = ..., clusters: _Optional[_Union[ClusterTerms, _Mapping]] = ..., knn: _Optional[_Union[KnnTerms, _Mapping]] = ..., teachers: _Optional[_Union[TeacherTerms, _Mapping]] = ..., dpsgd: _Optional[_Union[DpsgdTerms, _Mapping]] = ..., mechanism: _Optional[str] = ..., sigma: _Optional[float] = ..., max_batch: _Optional[int] = ..., rounds: _Optional[int] = ..., lifetime_epsilon: _Optional[float] = ..., classes: _Optional[_Iterable[str]] = ..., public_pool: _Optional[_Union[Tensor, _Mapping]] = ..., reading: _Optional[_Union[PublicReading, _Mapping]] = ...) -> None: ...

class PublicReading(_message.Message):
    __slots__ = ("columns", "fill", "image_size")
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    columns: _containers.RepeatedScalarFieldContainer[str]
    fill: _containers.RepeatedScalarFieldContainer[float]
    image_size: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, columns: _Optional[_Iterable[str]] = ..., fill: _Optional[_Iterable[float]] = ..., image_size: _Optional[_Iterable[int]] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("run", "planned_epsilon", "delta", "cell_bound")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CELL_BOUND_FIELD_NUMBER: _ClassVar[int]
    run: str
    planned_epsilon: float
    delta: float
    cell_bound: int
    def __init__(self, run: _Optional[str] = ..., planned_epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., cell_bound: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("run", "round", "batch")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    run: str
    round: int
    batch: int
    def __init__(self, run: _Optional[str] = ..., round: _Optional[int] = ..., batch: _Optional[int] = ...) -> None: ...

class SignedKey(_message.Message):
    __slots__ = ("owner", "certificate", "public_key", "cell_bound", "run", "round", "batch", "classes", "sigma", "signature", "dimension", "max_grad_norm", "scale_bits", "steps", "sample_rate")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    CELL_BOUND_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    SIGMA_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    SCALE_BITS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    certificate: bytes
    public_key: bytes
    cell_bound: int
    run: str
    round: int
    batch: int
    classes: int
    sigma: float
    signature: bytes
    dimension: int
    max_grad_norm: float
    scale_bits: int
    steps: int
    sample_rate: float
    def __init__(self, owner: _Optional[str] = ..., certificate: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., cell_bound: _Optional[int] = ..., run: _Optional[str] = ..., round: _Optional[int] = ..., batch: _Optional[int] = ..., classes: _Optional[int] = ..., sigma: _Optional[float] = ..., signature: _Optional[bytes] = ..., dimension: _Optional[int] = ..., max_grad_norm: _Optional[float] = ..., scale_bits: _Optional[int] = ..., steps: _Optional[int] = ..., sample_rate: _Optional[float] = ...) -> None: ...

class VotesRequest(_message.Message):
    __slots__ = ("run", "round", "inputs", "parties")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    run: str
    round: int
    inputs: Tensor
    parties: _containers.RepeatedCompositeFieldContainer[SignedKey]
    def __init__(self, run: _Optional[str] = ..., round: _Optional[int] = ..., inputs: _Optional[_Union[Tensor, _Mapping]] = ..., parties: _Optional[_Iterable[_Union[SignedKey, _Mapping]]] = ...) -> None: ...

class VotesReply(_message.Message):
    __slots__ = ("share", "epsilon_spent", "charges")
    SHARE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    share: Tensor
    epsilon_spent: float
    charges: int
    def __init__(self, share: _Optional[_Union[Tensor, _Mapping]] = ..., epsilon_spent: _Optional[float] = ..., charges: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("run", "round", "weights", "parties", "trained")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    run: str
    round: int
    weights: _containers.RepeatedCompositeFieldContainer[Tensor]
    parties: _containers.RepeatedCompositeFieldContainer[SignedKey]
    trained: Tensor
    def __init__(self, run: _Optional[str] = ..., round: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., parties: _Optional[_Iterable[_Union[SignedKey, _Mapping]]] = ..., trained: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("share", "epsilon_spent", "charges")
    SHARE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    share: Tensor
    epsilon_spent: float
    charges: int
    def __init__(self, share: _Optional[_Union[Tensor, _Mapping]] = ..., epsilon_spent: _Optional[float] = ..., charges: _Optional[int] = ...) -> None: ...

class NearPrivateRequest(_message.Message):
    __slots__ = ("run", "round", "weights", "parties", "projection", "public_points", "threshold")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_POINTS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    run: str
    round: int
    weights: _containers.RepeatedCompositeFieldContainer[Tensor]
    parties: _containers.RepeatedCompositeFieldContainer[SignedKey]
    projection: Tensor
    public_points: Tensor
    threshold: float
    def __init__(self, run: _Optional[str] = ..., round: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., parties: _Optional[_Iterable[_Union[SignedKey, _Mapping]]] = ..., projection: _Optional[_Union[Tensor, _Mapping]] = ..., public_points: _Optional[_Union[Tensor, _Mapping]] = ..., threshold: _Optional[float] = ...) -> None: ...

class BudgetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BudgetReply(_message.Message):
    __slots__ = ("owner", "epsilon_limit", "delta", "epsilon_spent", "charges")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    owner: str
    epsilon_limit: float
    delta: float
    epsilon_spent: float
    charges: int
    def __init__(self, owner: _Optional[str] = ..., epsilon_limit: _Optional[float] = ..., delta: _Optional[float] = ..., epsilon_spent: _Optional[float] = ..., charges: _Optional[int] = ...) -> None: ...
