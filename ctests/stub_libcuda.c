/* A stand-in libcuda.so.1 for the ctest cuda_stub_libcuda: the driver library is present but the
 * host has no GPU. cuInit fails with CUDA_ERROR_NO_DEVICE (100) like NVIDIA's driver without a
 * device; the error-string entry points answer; nothing else is exported. */
typedef int CUresult;

enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_NO_DEVICE = 100 };

int kvstage_stub_libcuda = 1; /* marker: the test checks that this library is the one loaded */

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    if (name == 0) return CUDA_ERROR_INVALID_VALUE;
    *name = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    if (text == 0) return CUDA_ERROR_INVALID_VALUE;
    *text = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected" : "unknown error";
    return CUDA_SUCCESS;
}
