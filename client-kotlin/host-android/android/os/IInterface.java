// Host stand-in for android.os.IInterface (JVM tests only; the device has the real one).
package android.os;

public interface IInterface {
    IBinder asBinder();
}
