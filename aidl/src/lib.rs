//! llmd's AIDL interfaces (`aidl/com/llmd/*.aidl`), compiled to Rust by rsbinder-aidl.
//! Interface version: `ILlmService::VERSION`.

#![allow(clippy::all, non_snake_case, missing_docs)]

rsbinder::include_aidl!("llmd_aidl");

pub use com::llmd::*;

/// The Binder-over-socket endpoint at `path`, with the android-13+ wire (needed for callbacks on
/// their own connections). The daemon serves it and every client connects to it: one definition.
pub fn socket_uri(path: &std::path::Path) -> rsbinder::Uri {
    rsbinder::Uri::from(rsbinder::Endpoint::unix(path))
        .with_wire(rsbinder::entry::WireProfile::Android13Plus(rsbinder::entry::WireVersion::MAX))
}

/// Reads an `ErrorCode` back out of a Binder status (client side).
pub fn error_code_of(status: &rsbinder::Status) -> Option<ErrorCode::ErrorCode> {
    (status.exception_code() == rsbinder::ExceptionCode::ServiceSpecific)
        .then(|| ErrorCode::ErrorCode(status.service_specific_error()))
}

/// The name of an `ErrorCode` value, for messages.
pub fn code_name(code: ErrorCode::ErrorCode) -> &'static str {
    use ErrorCode::ErrorCode as E;
    match code {
        E::OK => "OK",
        E::INVALID_ARGUMENT => "INVALID_ARGUMENT",
        E::MODEL_NOT_FOUND => "MODEL_NOT_FOUND",
        E::PERMISSION_DENIED => "PERMISSION_DENIED",
        E::QUOTA_EXCEEDED => "QUOTA_EXCEEDED",
        E::REQUEST_TOO_LARGE => "REQUEST_TOO_LARGE",
        E::BUSY => "BUSY",
        E::CANCELLED => "CANCELLED",
        E::SESSION_CLOSED => "SESSION_CLOSED",
        E::MODEL_LOAD_FAILED => "MODEL_LOAD_FAILED",
        E::INTERNAL => "INTERNAL",
        E::DEADLINE_EXCEEDED => "DEADLINE_EXCEEDED",
        _ => "UNKNOWN",
    }
}
