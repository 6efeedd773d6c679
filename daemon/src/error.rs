//! Every way a service call fails, and the one place it becomes an AIDL `ErrorCode`.

use llmd_aidl::ErrorCode::ErrorCode;
use llmd_engine::error::GenerateError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ServiceError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("model {0:?} is not installed")]
    ModelNotFound(String),
    #[error("uid {uid} may not call {method}")]
    PermissionDenied { uid: u32, method: &'static str },
    #[error("uid {uid} has reached its limit of {limit} {what}")]
    QuotaExceeded { uid: u32, what: &'static str, limit: usize },
    #[error("uid {uid} used its {limit} tokens per {window_s} s; retry in {retry_ms} ms")]
    TokenQuota { uid: u32, limit: usize, window_s: u64, retry_ms: u64 },
    #[error("request too large: {0}")]
    RequestTooLarge(String),
    #[error("busy: {0}")]
    Busy(String),
    #[error("request cancelled")]
    Cancelled,
    #[error("session is closed or not yours")]
    SessionClosed,
    #[error("session closed after {idle_s} s unused (limits.session_idle_timeout_s); open a new one")]
    SessionIdle { idle_s: u64 },
    #[error("model {id:?} failed to load: {reason}")]
    ModelLoadFailed { id: String, reason: String },
    #[error("model {id:?} is refused: its file changed since llmd registered it ({change}); restart llmd to register it anew")]
    ModelChanged { id: String, change: crate::integrity::Change },
    #[error("internal error: {0}")]
    Internal(String),
    #[error("deadline of {0} ms passed before the request finished")]
    DeadlineExceeded(u64),
    #[error("the client took no callback for {after_s} s (scheduler.stream_stall_timeout_s); the request was ended")]
    StreamStalled { after_s: u64 },
}

impl ServiceError {
    /// The wire code for this error. The only mapping from errors to `ErrorCode`.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidArgument(_) => ErrorCode::INVALID_ARGUMENT,
            Self::ModelNotFound(_) => ErrorCode::MODEL_NOT_FOUND,
            Self::PermissionDenied { .. } => ErrorCode::PERMISSION_DENIED,
            Self::QuotaExceeded { .. } | Self::TokenQuota { .. } => ErrorCode::QUOTA_EXCEEDED,
            Self::RequestTooLarge(_) => ErrorCode::REQUEST_TOO_LARGE,
            Self::Busy(_) => ErrorCode::BUSY,
            Self::Cancelled => ErrorCode::CANCELLED,
            Self::SessionClosed | Self::SessionIdle { .. } => ErrorCode::SESSION_CLOSED,
            // A model file that no longer matches its fingerprint cannot be loaded or served.
            Self::ModelLoadFailed { .. } | Self::ModelChanged { .. } => ErrorCode::MODEL_LOAD_FAILED,
            Self::Internal(_) => ErrorCode::INTERNAL,
            // A time bound passed before the request finished: the client's own, or the one
            // on how long a client may leave its callbacks untaken.
            Self::DeadlineExceeded(_) | Self::StreamStalled { .. } => ErrorCode::DEADLINE_EXCEEDED,
        }
    }

    /// As a Binder status: a service-specific error carrying the code and this message.
    pub fn into_status(self) -> rsbinder::Status {
        let code = self.code().0;
        rsbinder::Status::new_service_specific_error(code, Some(self.to_string()))
    }
}

impl From<GenerateError> for ServiceError {
    fn from(e: GenerateError) -> Self {
        match e {
            GenerateError::InvalidSampling { .. } | GenerateError::EmptyPrompt => Self::InvalidArgument(e.to_string()),
            GenerateError::ContextOverflow { .. } => Self::RequestTooLarge(e.to_string()),
            GenerateError::Tokenizer(_) | GenerateError::ChatTemplate(_) => Self::InvalidArgument(e.to_string()),
            // The weights it read in place lost a page (the file shrank under us): the model's
            // file is broken, not the service.
            GenerateError::Backend(llmd_engine::error::BackendError::ModelFileTruncated(_)) => {
                Self::ModelLoadFailed { id: "the session's model".into(), reason: e.to_string() }
            }
            GenerateError::Backend(_) => Self::Internal(e.to_string()),
        }
    }
}

pub use llmd_aidl::{code_name, error_code_of};
